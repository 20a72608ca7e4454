#!/usr/bin/env bash
# Install Debian's slurm-wlm and munge for the Slurm tests (tests/functional/test_slurm.py), only
# when they are missing and this runs as root with apt-get. Never fails: without them those
# tests skip and say why.
if command -v slurmctld >/dev/null || [[ -x /usr/sbin/slurmctld ]]; then
    exit 0
fi
if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "[setup_slurm] slurm-wlm is not installed and cannot be here (needs root and" \
         "apt-get): the Slurm tests skip" >&2
    exit 0
fi
echo "[setup_slurm] installing slurm-wlm munge (Debian packages) for the Slurm tests" >&2
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends slurm-wlm munge; } >/dev/null 2>&1; then
    echo "[setup_slurm] apt-get could not install slurm-wlm munge: the Slurm tests skip" >&2
fi
exit 0
