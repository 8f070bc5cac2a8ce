"""zerolens.track for the training frameworks that run the loop themselves: hf.py (a transformers
TrainerCallback) and lightning.py (a Lightning Callback), each an optional extra. They import tracking/.
"""
