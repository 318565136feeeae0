"""Run under a release environment's python: print to stderr the version banners that release's own code
logs, through its own logger (vllm.logger's handler and format), and exit.

- Where the release has ``log_version_and_model`` (vllm/entrypoints/utils.py 0.20.0:277-299,
  serve/utils/api_utils.py 0.27.0:323, common/startup.py 0.34.0:16), it is called as the API server calls it, once
  with vLLM's plain format and once as if the
  output were a colour terminal's (its logo, "version X" among escape codes).
- The banners logged inline (``logger.info("vLLM API server version %s", VLLM_VERSION)`` in
  entrypoints/openai/api_server.py up to 0.14; "Initializing a V1 LLM engine (v%s) with config: %s" in
  v1/engine/core.py) are found in the installed source by their logger call (ast), and that call's own
  format string is logged with the release's version: the wording is the wheel's, not a copy.
"""

from __future__ import annotations

import ast
import importlib
import logging
import pathlib


def inline_formats(path: pathlib.Path) -> list[str]:
    """The constant format strings of the logger calls in ``path`` that state the version."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("info", "info_once")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            text = node.args[0].value
            if "server version %s" in text or "LLM engine (v%s)" in text:
                found.append(text)
    return found


def main() -> None:
    import vllm
    import vllm.logger
    from vllm.logger import init_logger
    from vllm.version import __version__ as version

    root = pathlib.Path(vllm.__file__).parent
    # vLLM's logging as its entry points set it up (older releases do it at import), as worker_main.py does.
    if not logging.getLogger("vllm").handlers and hasattr(vllm.logger, "_configure_vllm_root_logger"):
        vllm.logger._configure_vllm_root_logger()
    logger = init_logger("vllm.entrypoints.openai.api_server")
    for relative in ("entrypoints/openai/api_server.py", "v1/engine/core.py"):
        path = root / relative
        if path.exists():
            for text in inline_formats(path):
                logger.info(text, *([version, "model='kvguard/qwen'"][: text.count("%s")]))
    # Where the release defines it (utils.py 0.20, serve/utils/api_utils.py 0.27, common/startup.py 0.34).
    for relative in ("entrypoints/utils.py", "entrypoints/serve/utils/api_utils.py", "entrypoints/common/startup.py"):
        path = root / relative
        if not path.exists() or "def log_version_and_model" not in path.read_text(encoding="utf-8"):
            continue
        owner = importlib.import_module("vllm." + relative[:-3].replace("/", "."))
        owner.log_version_and_model(logger, version, "kvguard/qwen")
        # The logo as a colour terminal gets it: the formatter type the function asks for, forced.
        if hasattr(owner, "current_formatter_type"):
            owner.current_formatter_type = lambda lgr: "color"
            owner.log_version_and_model(logger, version, "kvguard/qwen")
        break


if __name__ == "__main__":
    main()
