"""Retrofit a pretrained causal LM with an attention-zoo variant: attention transfer layer by layer, the layers that
keep full attention chosen by measurement or pattern, fine-tuning with distillation, zoo eval, a Hub-ready folder.

    python recipes/retrofit.py recipes/configs/retrofit/smollm2_gated_deltanet_cpu.yaml [--stages stage1 eval]

The logic lives in zoo/retrofit/ (zoo/retrofit/config.py lists every key); the manual: docs/recipes/retrofit.md.
"""

from zoo.retrofit.__main__ import main

if __name__ == "__main__":
    main()
