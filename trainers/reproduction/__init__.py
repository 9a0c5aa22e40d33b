"""Published rows as recipes, and reproducing them."""
