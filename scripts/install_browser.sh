#!/usr/bin/env bash
# Installs what the chat page's browser test (tests/test_serve_chat_page.py) drives:
# Debian's chromium and its chromedriver, with apt, only when one is missing.
# Idempotent; needs root (or sudo) the first time. The Python client (selenium)
# is pinned in requirements.txt.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
echo "== installing chromium and chromium-driver (apt)"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
  chromium chromium-driver >/dev/null
