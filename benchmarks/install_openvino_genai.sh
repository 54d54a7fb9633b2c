#!/usr/bin/env bash
# Installs OpenVINO GenAI (the co-tenant benchmark's optional baseline) from the package index
# into its own venv, never into the project's: its wheels pin their own numpy / tokenizers.
# Idempotent; prints the venv's python. Usage: bash benchmarks/install_openvino_genai.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${OPENVINO_GENAI_VERSION:-2026.4.1.0}"
VENV="$ROOT/.cache/openvino_genai/$VERSION"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import openvino_genai" 2>/dev/null; then
  python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check "openvino-genai==$VERSION" >&2
fi
echo "$VENV/bin/python"
