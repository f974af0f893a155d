# The ckptstore metadata service (docker-compose.yml builds it). Storage clients for S3 and GCS included.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ckptstore ckptstore
COPY server server
COPY client client
RUN pip install ".[server,s3,gcs]" \
    && useradd --system --uid 10001 --home-dir /var/lib/ckptstore --create-home ckptstore
USER ckptstore
VOLUME ["/var/lib/ckptstore"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --retries=6 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=4)"]
CMD ["ckptstore", "serve", "--host", "0.0.0.0", "--port", "8080"]
