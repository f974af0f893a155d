"""The resume audit: whether a resumed run is the saved one — what the code declares, compared before
anything is assigned (declared.py), and what the resumed run does at its first step, against what the
saved run would have done next (proof.py)."""

__all__: list[str] = []
