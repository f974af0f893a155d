# Sourced by the README's commands: create .venv (Python 3.11) if needed and install ckptstore with
# the extras given as $1, in one resolver run (s3fs/gcsfs/aiobotocore pins must agree with moto's botocore).
ensure_venv() {
  local python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  # PyTorch alone first: resolved together with the rest, pip takes PyPI's CUDA build (several GB)
  # over the CPU build (torch 2.13.0+cpu) that this kind of machine keeps on disk.
  case ",$1," in *,all,* | *,torch,*) .venv/bin/python -m pip install --quiet "torch==2.13.0" ;; esac
  .venv/bin/python -m pip install --quiet -e ".[$1]"
}
