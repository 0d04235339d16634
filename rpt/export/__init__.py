"""Models out of rpt and into the tools users have: transformers folders (rpt export) and lm-eval (rpt lm-eval)."""
