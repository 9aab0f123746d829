"""Agent programs that drive a Tandem run's episodes from outside, through its OpenAI-compatible endpoint."""
