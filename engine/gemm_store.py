"""The GEMM choice a compiling engine's probes made, kept beside its compile cache, so that its
next start and every replica sharing the cache volume run (and compile) the same GEMMs.

The start-up probes (``kernels.capabilities``) time this CPU's GEMMs. Where a C kernel and
torch's GEMM run a row count within the probes' noise of the threshold (a 2-core Zen 4 EPYC's
bfloat16 kernel at 128 rows: 1.03-1.12x against 1.1x), starts choose differently by chance.
The choice is a branch of the compiled graph and so a field of the compile cache's key: a start
that chose otherwise missed the cache a previous one wrote (185 s to compiled on that EPYC
instead of 120 s with a hit). And the kernels round differently, so replicas that chose
differently may give different greedy answers.

So the first settled choice (a probe run that other processes left the CPUs to) is stored at
``<compile cache root>/gemm/<key>.json``, the key a digest of what the choice depends on: the
CPU, the compiler that built the kernels, torch, llmpool, the dtype and the GEMM's shape. Later
starts take it instead of probing. The file is published create-if-absent: of replicas probing
at once, the first to publish wins and the others take its choice. Deleting the file makes the
next start probe again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from llmpool.engine.compile_cache import cache_key
from llmpool.engine.kernels.capabilities import GemmDecision, GemmProbe
from llmpool.engine.models.linear import GemmChoice

logger = logging.getLogger(__name__)

FOLDER = "gemm"


class GemmStore:
    """The stored choice for one CPU, toolchain, dtype and GEMM shape (``fields``)."""

    def __init__(self, root: Path, fields: Mapping[str, str]) -> None:
        self.fields = dict(fields)
        self.path = root / FOLDER / f"{cache_key(fields)}.json"

    def load(self) -> GemmDecision | None:
        """The stored choice; None where there is none, or it cannot be read (logged)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("ignoring the stored GEMM choice %s: %s", self.path, error)
            return None
        try:
            record = json.loads(text)
            probe = record["probe"]
            gemm = GemmChoice(**record["gemm"])
            share = probe["neighbourShare"]
            rows = (
                gemm.bfloat16_kernel_max_rows,
                gemm.bfloat16_upcast_min_rows,
                gemm.float32_kernel_max_rows,
            )
            if not all(row is None or type(row) is int for row in rows) or not (
                share is None or isinstance(share, float | int)
            ):
                raise TypeError("row counts must be integers or null, the share a number")
            return GemmDecision(
                gemm, str(record["says"]), GemmProbe(int(probe["attempts"]), share, stored=True)
            )
        except (ValueError, TypeError, KeyError) as error:
            logger.warning("ignoring the stored GEMM choice %s: %r", self.path, error)
            return None

    def discard(self, why: str) -> None:
        """Delete the stored choice, logged with ``why``."""
        logger.warning("discarding the stored GEMM choice %s: %s", self.path, why)
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:
            logger.warning("cannot delete %s: %s", self.path, error)

    def publish(self, choice: GemmDecision) -> GemmDecision:
        """Store ``choice`` unless another start stored one first; the choice that stands.

        A stored file that cannot be read is replaced; where nothing can be written (a
        read-only volume), ``choice`` stands for this start alone, logged.
        """
        record = {
            "gemm": dataclasses.asdict(choice.gemm),
            "says": choice.says,
            "probe": {
                "attempts": choice.probe.attempts,
                "neighbourShare": choice.probe.neighbour_share,
            },
            "key": self.fields,
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            descriptor, staging = tempfile.mkstemp(prefix=".gemm.", dir=self.path.parent)
        except OSError as error:
            logger.warning("cannot store the GEMM choice under %s: %s", self.path.parent, error)
            return choice
        try:
            with os.fdopen(descriptor, "w") as file:
                json.dump(record, file, indent=1, sort_keys=True)
            try:
                os.link(staging, self.path)
            except FileExistsError:
                stored = self.load()
                if stored is not None:
                    return stored
                os.replace(staging, self.path)
            except OSError:  # a volume without hard links (SMB): the last to publish wins
                os.replace(staging, self.path)
            return choice
        except OSError as error:
            logger.warning("GEMM choice not stored at %s: %s", self.path, error)
            return choice
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
