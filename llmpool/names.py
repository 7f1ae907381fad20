"""Model names: the one grammar served names and adapter names follow, and the one form names
are compared in.

A name is what a client sends as ``model``: an LLMPool's ``spec.model.servedName``, an adapter's
``spec.adapters[].name``, the engine's ``--served-model-name`` and the adapter names of
``--lora-modules`` and ``/v1/load_lora_adapter``. It is 1 to ``NAME_MAX_LENGTH`` ASCII letters,
digits, ``.``, ``_``, ``-`` and ``:``, starting with a letter or a digit (``llama-3.2-1b-instruct``,
``Qwen2.5-7B-Instruct``, ``qwen2.5:7b``). No ``/``: ``namespace/name`` is how a caller names one
namespace's model at the gateway, and a name must never read as another namespace's.

Names are compared in their normal form (Unicode NFKC, then case folded), so that a caller
cannot tell ``Chat``, ``chat`` and ``ｃｈａｔ`` (fullwidth) apart by where they are routed, and
two namespaces cannot claim one name in two spellings. Standard library only: every program
imports it.
"""

from __future__ import annotations

import re
import unicodedata

NAME_MAX_LENGTH = 128
# As the CRD writes it (crds/llmpool.yaml: `pattern` beside `maxLength: NAME_MAX_LENGTH`).
NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:-]*$"
NAME_GRAMMAR = (
    f"1 to {NAME_MAX_LENGTH} ASCII letters, digits, '.', '_', '-' and ':', starting with a"
    " letter or a digit (no '/')"
)
_NAME = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$"))
# A qualified name is a namespace (a DNS label, at most 63) and a name; a longer ``model`` names
# nothing, whatever its normal form, and is not normalised.
_QUALIFIED_MAX_LENGTH = 4 * (63 + 1 + NAME_MAX_LENGTH)


def name_error(name: object, field: str) -> str | None:
    """Why ``name`` is not a valid name for ``field`` (said with the field's name), or None."""
    if not isinstance(name, str):
        return f"{field} must be a string, got {type(name).__name__}"
    if len(name) > NAME_MAX_LENGTH:
        return f"{field} has {len(name)} characters; a name has at most {NAME_MAX_LENGTH}"
    if _NAME.fullmatch(name) is None:
        return f"{field} {name!r} is not a valid name: {NAME_GRAMMAR}"
    return None


def check_name(name: str, field: str) -> str:
    """``name`` if it is valid, else a ValueError naming ``field`` and the grammar."""
    error = name_error(name, field)
    if error is not None:
        raise ValueError(error)
    return name


def is_valid_name(name: object) -> bool:
    return name_error(name, "name") is None


def normalize(name: str) -> str:
    """The form names are compared in: Unicode NFKC, case folded (NFKC again after folding,
    which can leave text that is not in NFKC)."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())


def split_qualified(model: str) -> tuple[str | None, str] | None:
    """A requested ``model`` as (namespace, name), both normalised; namespace None for a bare
    name. Normalised first, then split at the first ``/``: a fullwidth solidus qualifies as
    ``/`` does. None when it cannot name anything (too long, or a name part with a ``/``)."""
    if len(model) > _QUALIFIED_MAX_LENGTH:
        return None
    namespace, slash, name = normalize(model).partition("/")
    if not slash:
        return None, namespace
    if "/" in name:
        return None
    return namespace, name
