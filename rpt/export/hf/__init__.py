"""The model as transformers remote code: configuration_rpt.py and modeling_rpt.py, copied into every export."""
