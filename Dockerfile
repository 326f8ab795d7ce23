# One image for every mesh role: `docker run agent-mesh manager`, `… agent calc`, `… demo`.
# Used by docker-compose.yml; the broker URL comes from MESH_AMQP_URL. `pip install .` brings
# the PostgreSQL driver too (psycopg[binary], libpq included), so `mesh manager --ledger
# postgresql://…` works in this slim image with no system package; the otel extra lets every
# process export traces when OTEL_TRACES_EXPORTER is set (docker-compose.yml: to Jaeger).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# README.md* : the project metadata refers to it, but the build must not fail without it.
COPY pyproject.toml README.md* ./
COPY mesh ./mesh
RUN pip install '.[otel]' \
    && rm -rf /src \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin mesh \
    && mkdir -p /home/mesh/.mesh \
    && chown mesh:mesh /home/mesh/.mesh

USER mesh
WORKDIR /home/mesh
# The journal (.mesh/orchestration.sqlite3) lives under /home/mesh/.mesh: mount a volume there.
ENV MESH_AMQP_URL=amqp://guest:guest@rabbitmq:5672/
ENTRYPOINT ["mesh"]
CMD ["--help"]
