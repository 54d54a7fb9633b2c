"""Training draft heads (EAGLE, EAGLE-3) for a target model on the CPU: `specdec train-draft`.

corpus.py  the shipped prompt corpus (training and held-out prompts never overlap)
data.py    target greedy continuations + captured hidden states + soft labels, via the Engine
heads.py   the heads as trainable modules, saved in the published checkpoint layouts
trainer.py the training loop (progress, checkpoints, resume) and held-out evaluation
"""
