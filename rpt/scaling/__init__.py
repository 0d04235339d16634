"""`rpt scaling`: the compute-optimal frontier of a user's data, measured.

A grid of short `rpt train` runs at several training-FLOP budgets (grid.py, run by runner.py), a scaling law fitted
to their final losses as the literature fits one (fit.py: Chinchilla's approaches 2 and 3, repeated data counted as
Muennighoff et al. 2023 count it), and the law as a file with its provenance (law.py), which the default recipe
reads to size a run (rpt/train/recipe.py). report.py prints the table and draws the frontier.
"""
