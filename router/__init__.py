"""Router: the public GenerationService; picks workers and relays tokens."""
