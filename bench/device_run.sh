#!/usr/bin/env bash
# The device check on a lent GPU machine, as one command (the device tool's `run`, with
# carry [".whl"] and timeout_s 420):
#
#     bash bench/device_run.sh                       # every section, 330 s budget
#     bash bench/device_run.sh --sections conv3d,wan_vae,snake --budget-s 300
#     DEVICE_RUN_TIMEOUT_S=575 bash bench/device_run.sh --sections regions --budget-s 540
#                     # (timeout_s 600, and as much device time left: regions, a run of its own)
#
# Installs the carried wheels (.whl/, ignored via .git/info/exclude: packages the machine lacks;
# for the H200 image: diffusers==0.42.1 alone (py3-none-any; its other needs are there), made with
# `pip download --no-deps`, see /work/.library/device/README.md) into /tmp/site, puts that and
# this tree on PYTHONPATH, runs bench/device_check.py (extra arguments go to it) with its files
# in $OUT (or ./device-check-out), and keeps the whole log in $OUT/device_check.log.
# A failing wheel install is reported and the check still runs (sections needing the package
# then record an error).  A hard `timeout` backs up the script's own watchdog.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-device-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl 2>&1 | tail -5 || echo "device_run: wheel install failed"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ echo "device_run: $($PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())' 2>&1)"
  nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader 2>&1 | head -2
  timeout -k 10 "${DEVICE_RUN_TIMEOUT_S:-400}" $PY bench/device_check.py --out "$OUT" "$@"
  echo "device_run: device_check exit status $?"; } 2>&1 | tee "$OUT/device_check.log"
