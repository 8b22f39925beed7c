"""MIG: which instance each holder uses, and an instance's recovery plan."""
