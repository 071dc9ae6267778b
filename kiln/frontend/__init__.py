"""torch.export -> Graph IR. The only compiler package that imports torch."""
