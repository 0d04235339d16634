"""What rpt ships for testing a deployment: fault injection (faults.py)."""
