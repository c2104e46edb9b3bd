FROM python:3.11-slim
WORKDIR /app
# Production installs balancer alone; the compose `sim` service builds with
# EXTRAS="[demo]" for the simulated Models Backend (fastapi, uvicorn).
ARG EXTRAS=""
COPY pyproject.toml README.md celeryconfig.py ./
COPY balancer ./balancer
RUN pip install --no-cache-dir ".${EXTRAS}"
# The directories compose mounts named volumes on: a new volume takes the
# ownership of the image's directory, so the app user can write the inbox
# (ingest moves files to done/ and rejected/) and beat its schedule.
RUN useradd --create-home balancer \
    && mkdir -p /inbox /var/lib/balancer \
    && chown balancer:balancer /inbox /var/lib/balancer
USER balancer
