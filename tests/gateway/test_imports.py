"""The gateway's process stays small: it imports the engine server's OpenAI layer, never torch."""

import subprocess
import sys


def test_the_gateway_does_not_import_torch() -> None:
    code = "import sys, llmpool.cli, llmpool.gateway.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", "importing the gateway loaded torch (~500 MB of RSS)"
