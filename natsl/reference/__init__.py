"""Pure-PyTorch reference of NAtS-L: readable, recurrent, explicit masks. The definition of correct."""
