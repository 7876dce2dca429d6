# The same install as the README's set-up command, so the tested path is the shipped path.
#   docker build -t dlpipe .
#   docker run --rm --shm-size=1g --cpus=4 -v "$PWD/runs:/runs" -w /runs dlpipe +recipe=vision
# --shm-size: DataLoader workers hand batches over through /dev/shm, and Docker's 64 MB default is
#   too small for image batches from several workers.
# --cpus: sets a cgroup CPU quota, which ${auto_workers:} reads (os.cpu_count() does not).
# On a GPU host, install the CUDA build of torch instead of the CPU pin and run with --gpus all.
FROM python:3.11-slim

WORKDIR /opt/dlpipe
COPY pyproject.toml README.md ./
COPY dlpipe ./dlpipe
COPY conf ./conf
COPY recipes ./recipes

RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .

WORKDIR /runs
ENTRYPOINT ["dlpipe"]
CMD ["+recipe=vision"]
