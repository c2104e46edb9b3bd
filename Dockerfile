FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md celeryconfig.py ./
COPY balancer ./balancer
RUN pip install --no-cache-dir .
RUN useradd --create-home balancer
USER balancer
