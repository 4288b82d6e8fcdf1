#!/usr/bin/env bash
# Installs bubblewrap (bwrap), which the code task's sandbox (gyre/envs/sandbox.py) needs.
# Idempotent and non-interactive: does nothing when bwrap is already on PATH; otherwise
# apt-get install, running apt-get update only if the first install attempt fails.
set -euo pipefail

if command -v bwrap >/dev/null 2>&1; then
    echo "install_sandbox: bwrap already installed: $(command -v bwrap) ($(bwrap --version 2>/dev/null || echo 'version unknown'))"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_sandbox: bwrap is missing and apt-get is not available; install the 'bubblewrap' package by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
        echo "install_sandbox: need root (or sudo) to install bubblewrap" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
APT=(apt-get install -y -q --no-install-recommends bubblewrap)
echo "install_sandbox: bwrap missing; running: ${APT[*]}"
if ! $SUDO "${APT[@]}"; then
    echo "install_sandbox: install failed; running apt-get update and retrying"
    $SUDO apt-get update -q
    $SUDO "${APT[@]}"
fi
echo "install_sandbox: installed $(command -v bwrap) ($(bwrap --version))"
