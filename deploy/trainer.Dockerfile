# A training container with no storage credentials (docker-compose.yml's `train` profile): it reads and
# writes its checkpoints through URLs the service signs (CKPTSTORE_PRESIGNED=1), so it needs neither
# AWS_* variables nor an S3 client — only the service's address and a token.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=3
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ckptstore ckptstore
COPY server server
COPY client client
COPY scripts/demo.py scripts/demo.py
RUN pip install ".[tf]" \
    && useradd --system --uid 10002 --home-dir /home/trainer --create-home trainer
USER trainer
CMD ["python", "scripts/demo.py", "--train", "http://ckptstore:8080", "s3://ckpt/jobs", "-"]
