"""What is learned and how it is scored: datasets, reward functions, grading, the arithmetic task, the tiny model."""
