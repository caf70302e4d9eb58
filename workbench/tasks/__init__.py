"""What is learned and how it is scored, below the recipe: the run's Task (task.py: each split's source, its rows
read once, its rewards), datasets (dataset.py), the arithmetic task (arithmetic.py), reward functions (rewards.py)
and their recipe specs (rewardspec.py), grading (grading.py). Only workbench.errors is imported here."""
