"""Fine-tune one model with one attention-zoo variant on one task; the settings are in a YAML config.

    python recipes/finetune.py recipes/configs/smoke.yaml [--key value ...]
    accelerate launch --config_file recipes/accelerate/multi_cpu.yaml recipes/finetune.py recipes/configs/smoke.yaml

The logic lives in zoo/training/finetune.py (FinetuneConfig in zoo/training/config.py lists every key).
"""

from zoo.training.finetune import main

if __name__ == "__main__":
    main()
