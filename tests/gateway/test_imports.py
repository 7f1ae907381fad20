"""The gateway's process stays small: it imports the OpenAI protocol (``llmpool.protocol``), never
the engine or torch."""

import subprocess
import sys


def test_the_gateway_does_not_import_torch() -> None:
    code = (
        "import sys, llmpool.cli, llmpool.gateway.cli, llmpool.gateway.app, llmpool.protocol.http,"
        " llmpool.protocol.requests; print('torch' in sys.modules,"
        " any(name.startswith('llmpool.engine') for name in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"], "importing the gateway loaded the engine"
