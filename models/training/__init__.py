"""Train the project's own small target/drafter pair from Python source already on the machine.

Pipeline (each step is a module with a CLI):

1. ``corpus``    stdlib + site-packages ``.py`` files → deterministic train/valid text + manifest
2. ``tokenizer`` byte-level BPE (default vocab 4096) saved in Hugging Face format
3. ``train``     one preset (``presets``) under a wall-clock budget → ``save_pretrained`` directory
   with tokenizer, ``training.json`` and ``card.md``
4. ``make_pair`` all of the above for a target (NemotronH hybrid) and a drafter (Mamba2)
5. ``sample``    eyeball a continuation

``ssd_scan`` is a faster, numerically equivalent replacement for transformers' pure-PyTorch
Mamba2 chunk scan, swapped in only while training. ``data`` tokenises and caches corpus splits.
Nothing here is imported by the serving code; the checkpoints are ordinary transformers ones.
"""
