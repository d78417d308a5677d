#!/usr/bin/env bash
# bubblewrap for the reward service's code sandbox (services/reward/sandbox). Idempotent: nothing to do when bwrap is
# on PATH; otherwise Debian's package via apt-get (as root, or through sudo).
set -euo pipefail

have_libseccomp() { ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; }
# libseccomp2: the sandboxed programs' seccomp filter (services/reward/sandbox/seccomp.py); Debian's apt needs it too
if command -v bwrap >/dev/null 2>&1 && have_libseccomp; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_bwrap: bwrap is missing and there is no apt-get here: install bubblewrap (>= 0.8) with your package manager" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "install_bwrap: bwrap is missing; run 'apt-get install -y bubblewrap' as root (no sudo here)" >&2
        exit 1
    fi
    SUDO="sudo"
fi
echo "install_bwrap: installing bubblewrap with apt-get" >&2
if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap libseccomp2 >/dev/null; then
    $SUDO apt-get update -qq >/dev/null || true
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap libseccomp2 >/dev/null || {
        echo "install_bwrap: apt-get could not install bubblewrap; the code sandbox cannot run without it" >&2
        exit 1
    }
fi
command -v bwrap >/dev/null 2>&1 || { echo "install_bwrap: bubblewrap installed but bwrap is not on PATH" >&2; exit 1; }
have_libseccomp || { echo "install_bwrap: libseccomp2 installed but the loader does not find libseccomp.so.2" >&2; exit 1; }
