"""Compare attention-zoo variants: one fine-tune per variant (each its own `accelerate launch`), one report.

    python recipes/compare.py recipes/configs/compare_default.yaml [--output_dir DIR] [--overwrite]

The logic lives in zoo/training/compare.py (config keys: docs/notes/training.md).
"""

from zoo.training.compare import main

if __name__ == "__main__":
    main()
