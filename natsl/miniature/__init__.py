"""The paper in miniature as one resumable pipeline (`natsl miniature`, docs/miniature.md)."""
