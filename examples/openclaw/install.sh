#!/usr/bin/env bash
# Installs Node.js 24 (npm's `node` package carries the binary) and the OpenClaw CLI from npm into one folder
# (default: .openclaw in the repository), once: a finished install leaves `.installed` and is not redone.
# npm itself comes from Debian's packages when it is missing (as root).
set -euo pipefail
DEST="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.openclaw}"
NODE_VERSION="${OPENCLAW_NODE_VERSION:-24}"
OPENCLAW_VERSION="${OPENCLAW_VERSION:-2026.9.6}"
MARKER="$DEST/.installed"
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "node@$NODE_VERSION openclaw@$OPENCLAW_VERSION" ]]; then
  exit 0
fi
if ! command -v npm >/dev/null; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install.sh: npm is missing: install Node.js and npm (any version; Node $NODE_VERSION comes from npm)" >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q npm >/dev/null
fi
mkdir -p "$DEST"
cd "$DEST"
[[ -f package.json ]] || echo '{"private": true}' > package.json
npm install --no-audit --no-fund --loglevel=error "node@$NODE_VERSION"
export PATH="$DEST/node_modules/.bin:$PATH"   # OpenClaw's install scripts check the Node that runs them
npm install --no-audit --no-fund --loglevel=error "openclaw@$OPENCLAW_VERSION"
openclaw --version
echo "node@$NODE_VERSION openclaw@$OPENCLAW_VERSION" > "$MARKER"
