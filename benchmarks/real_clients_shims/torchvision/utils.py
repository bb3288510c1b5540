def save_image(*args, **kwargs):
    raise NotImplementedError("torchvision stand-in: utils.save_image is not provided")


def make_grid(*args, **kwargs):
    raise NotImplementedError("torchvision stand-in: utils.make_grid is not provided")
