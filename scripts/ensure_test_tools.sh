#!/usr/bin/env bash
# The programs the suite's browser and metrics tests run: Chromium (driven by Playwright,
# never a downloaded browser) and promtool. `make test` calls this as it starts Redis: it
# installs what is missing with apt-get when it can (root, or sudo without a password),
# and otherwise says how, and the tests that need a missing one fail saying the same.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || need+=(chromium)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then echo "test tools: chromium and promtool found"; exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "test tools: missing ${need[*]}; install Chromium and Prometheus's promtool with your package manager" >&2
  echo "            (macOS: brew install --cask chromium; brew install prometheus)" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "test tools: missing ${need[*]}: run  sudo apt-get install -y --no-install-recommends ${need[*]}" >&2
    exit 0
  fi
fi
echo "test tools: installing ${need[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }; then
  echo "test tools: apt-get could not install ${need[*]}: install them by hand" >&2
  exit 0
fi
# The prometheus package may start a service of its own; the suite only wants promtool.
$SUDO systemctl stop prometheus >/dev/null 2>&1 || true
