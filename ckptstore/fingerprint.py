"""A checkpoint's fingerprint and the resume audit that compares it with the live run.

Each save records, in its manifest's metadata under FINGERPRINT_KEY, what the saved run was: the
framework and its versions, the world size and rank, the seed, every object's type and arrays
(names, shapes, dtypes), the optimizer's type and parameter coverage, and the data position as far
as ckptstore can see it (loader and sampler type, batch size, dataset length, seed). A restore
builds the same record from the live objects and `differences` names everything that differs. That
compares what the code declares; a resume is `exact` only once its proof (client/audit/proof.py:
what the resumed run draws and counts first, against what the saved run would have) agrees, and
`unverified` where the data cannot be observed. Framework clients build the records (client/);
this module only compares them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["FINGERPRINT_KEY", "Verdict", "differences", "verdict", "MAX_NAMED"]

FINGERPRINT_KEY = "fingerprint"
MAX_NAMED = 5  # differences named per object before "and N more"
Verdict = Literal["exact", "resharded", "drift", "unverified"]

_DATA_FIELDS = {
    "type": "loader",
    "sampler": "sampler",
    "batch_size": "batch size",
    "length": "dataset length",
    "seed": "seed",
    "shuffle": "shuffle",
    "workers": "worker processes",
    "generators": "generators (its own, its sampler's)",
    "steps": "steps per epoch",
}


def verdict(found: list[str], live: Mapping[str, Any] | None = None) -> Verdict:
    """The declared verdict (the proof may still find drift, or say `unverified`): `exact` when
    nothing differs; `resharded` when only the world size (and so the ranks' RNGs)
    differs and every data object of the live run continues its global order on any world size
    (`reshards` in its fingerprint); else `drift`."""
    if not found:
        return "exact"
    data = (live or {}).get("data") or {}
    reshards = bool(data) and all(isinstance(part, Mapping) and part.get("reshards") is True for part in data.values())
    world_only = all(f.startswith("world size:") or (f.startswith("rank ") and ": RNG from rank 0" in f) for f in found)
    return "resharded" if reshards and world_only and any(f.startswith("world size:") for f in found) else "drift"


def differences(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """Every way the live run differs from the saved one, each named in a sentence (empty: exact). The
    saved fingerprint is read from storage: untrusted input. One that does not have the shape this
    module writes (a number as text, a list for a mapping) is drift, said so, never an exception.
    Two positions of one run compare equal: what each leads to next is the proof's, not compared here
    (`ckptstore diff`)."""
    try:
        return _differences(saved, live)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:
        return [f"checkpoint: its fingerprint is malformed ({type(exc).__name__}: {exc}), so nothing could be compared"]


def _differences(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    found: list[str] = []
    found += _framework(saved.get("framework", {}), live.get("framework", {}))
    found += _world(saved, live)
    seed, rank = saved.get("seed"), live.get("world", {}).get("rank", 0)
    if rank < len(saved.get("rank_seeds") or ()):
        seed = saved["rank_seeds"][rank]  # replicated state: each rank's own seed
    if seed is not None and live.get("seed") is not None and seed != live["seed"]:
        found.append(f"seed: the saved run was seeded with {seed}, this run with {live['seed']}")
    found += _objects(saved.get("objects", {}), live.get("objects", {}))
    found += _data(saved.get("data", {}), live.get("data", {}))
    return found


def _framework(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    found = []
    if saved.get("name") != live.get("name"):
        found.append(f"framework: saved by {saved.get('name')}, restoring into {live.get('name')}")
    versions, now = saved.get("versions", {}), live.get("versions", {})
    for package in sorted(set(versions) & set(now)):
        if versions[package] != now[package]:
            found.append(f"framework: {package} {versions[package]} when saved, {now[package]} now")
    return found


def _world(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    found = []
    size, now = saved.get("world", {}).get("size", 1), live.get("world", {}).get("size", 1)
    if size != now:
        found.append(f"world size: saved by {size} process(es), restoring into {now}")
    rank = live.get("world", {}).get("rank", 0)
    rng_ranks = saved.get("rng_ranks")
    if rng_ranks is not None and rank >= rng_ranks:
        found.append(f"rank {rank}: RNG from rank 0 (the checkpoint holds the RNG of {rng_ranks} rank(s))")
    return found


def _objects(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    found = []
    for name in sorted(set(saved) - set(live)):
        found.append(f"{name}: saved, but not in objects now")
    for name in sorted(set(live) - set(saved)):
        found.append(f"{name}: in objects now, but not in the checkpoint")
    for name in sorted(set(saved) & set(live)):
        was, now = saved[name], live[name]
        if was.get("type") != now.get("type"):
            found.append(f"{name}: saved {was.get('type')}, restoring into {now.get('type')}")
        if was.get("params") is not None and now.get("params") is not None and was["params"] != now["params"]:
            found.append(f"{name}: saved for {was['params']} parameters, this one has {now['params']}")
        if was.get("slots") and now.get("slots") and was["slots"] != now["slots"]:
            found.append(f"{name}: its state held {was['slots']} when saved, {now['slots']} now")
        found += _arrays(name, was.get("arrays", {}), now.get("arrays", {}))
    return found


def _arrays(name: str, saved: Mapping[str, str], live: Mapping[str, str]) -> list[str]:
    changes = [f"{key} {saved[key]} → {live[key]}" for key in saved if key in live and saved[key] != live[key]]
    changes += [f"{key} ({saved[key]}) is gone" for key in saved if key not in live]
    changes += [f"{key} ({live[key]}) is new" for key in live if key not in saved]
    if not changes:
        return []
    more = f", and {len(changes) - MAX_NAMED} more" if len(changes) > MAX_NAMED else ""
    return [f"{name}: {'; '.join(changes[:MAX_NAMED])}{more}"]


def _data(saved: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    found = []
    for name in sorted(set(saved) & set(live)):
        was, now = saved[name], live[name]
        found += [
            f"data ({name}): {said} {was[field]} → {now[field]}"
            for field, said in _DATA_FIELDS.items()
            if field in was and field in now and was[field] != now[field]
        ]
    for name, now in sorted(live.items()):
        if now.get("inexact"):
            found.append(f"data ({name}): {now['inexact']}")
    return found
