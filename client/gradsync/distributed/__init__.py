"""gradsync as a torch.distributed backend (the coordinator-served store: `store`)."""
