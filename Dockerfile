FROM python:3.11-slim
WORKDIR /app
# Production installs balancer alone; the compose `sim` service builds with
# EXTRAS="[demo]" for the simulated Models Backend (fastapi, uvicorn).
ARG EXTRAS=""
COPY pyproject.toml README.md celeryconfig.py ./
COPY balancer ./balancer
RUN pip install --no-cache-dir ".${EXTRAS}"
RUN useradd --create-home balancer
USER balancer
