#!/usr/bin/env python3
"""Write a tiny random Mixtral checkpoint (sharded safetensors, bf16) for tests and the demo.

    python scripts/make_tiny_mixtral.py OUT_DIR --layers 2 --hidden 64 --intermediate 128 \
        --experts 4 --top-k 2 --names v4 --seed 0

See :func:`ts_moe.tiny.make_tiny_mixtral`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from ts_moe.tiny import main  # noqa: E402

if __name__ == "__main__":
    main()
