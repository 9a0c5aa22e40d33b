"""Looking at runs: the HTML report, its drawings, training curves."""
