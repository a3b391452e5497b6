#!/usr/bin/env bash
# Headless Chromium for tests/test_report_html.py (skipped without it). Debian package.
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi
