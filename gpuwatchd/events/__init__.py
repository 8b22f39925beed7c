"""The events: their catalogue, the words that render them, and the loggers that emit them."""
