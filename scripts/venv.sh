# Sourced by the README's commands: create .venv (Python 3.11) if needed and install ckptstore with
# the extras given as $1, in one resolver run (s3fs/gcsfs/aiobotocore pins must agree with moto's botocore).
ensure_venv() {
  local python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[$1]"
}
