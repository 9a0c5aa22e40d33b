"""Using a trained model: search a gallery with sentences or images."""
