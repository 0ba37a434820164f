"""Choose which KV heads keep the whole cache (DuoAttention, arXiv 2410.10819), two ways: DuoAttention's trained gates
and the training-free attention mass on needles; one Hub-ready ``duo`` model folder per method and share.

    python recipes/duo.py recipes/configs/duo/smollm2_cpu.yaml

The logic lives in zoo/retrofit/heads.py and zoo/retrofit/duo_gates.py; the manual: docs/recipes/choosing-heads.md.
"""

from zoo.retrofit.heads import main

if __name__ == "__main__":
    main()
