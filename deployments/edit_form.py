"""``POST /v1/images/edits``'s multipart form as an `ImageEditRequest`, the way OpenAI's route reads it.

The form holds the input image as one file field ``image`` (or several: ``image`` repeated, or ``image[]``,
as OpenAI's SDKs send a list), an optional ``mask`` file, and text fields: ``prompt``, ``model``, ``n``,
``size``, ``response_format``, ``output_format``, ``output_compression``, ``user``, this project's
``num_inference_steps``, ``guidance_scale``, ``seed``, ``lora_scale``, ``cache`` (a JSON object, as on
generations), ``num_frames`` (an image-to-video model's video length) and diffusers' ``strength``. Text fields are parsed as form values are (``"2"`` is the number
2), then validated by the same model a Python handle caller sends; anything else is an error naming the
field (`EditFormError`, the FastAPI error list's shape). The body's size was capped before it was read
(`deployments.security`, ``max_upload_bytes``). Torch-free.
"""
from __future__ import annotations

import json
from typing import List

from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from deployments.schemas import ImageEditRequest

__all__ = ["EditFormError", "MAX_FORM_FILES", "edit_request_from_form", "form_openapi"]

# file fields a form may hold at all (the model's own limit on images is checked when it is planned)
MAX_FORM_FILES = 17
_FILE_FIELDS = ("image", "image[]", "mask")


class EditFormError(ValueError):
    """A form that is not an edit request; `detail` is the FastAPI error list (``loc`` names the field)."""

    def __init__(self, detail: List[dict], status_code: int = 422):
        super().__init__(detail[0]["msg"])
        self.detail, self.status_code = detail, status_code


def _error(field: str, msg: str, status_code: int = 422, loc: str = "body") -> EditFormError:
    return EditFormError([{"loc": [loc, field], "msg": msg, "type": "value_error"}], status_code)


async def edit_request_from_form(request) -> ImageEditRequest:
    """The `ImageEditRequest` of a Starlette request whose body is a multipart form; `EditFormError` else."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise _error("content-type", "send the edit as multipart/form-data (curl -F), with its image as a file "
                     f"field 'image'; got {content_type or 'no content type'!r}", 400, loc="header")
    try:
        form = await request.form(max_files=MAX_FORM_FILES, max_fields=64)
    except (MultiPartException, HTTPException) as exc:  # Starlette raises the first as a 400 inside an app
        message = str(getattr(exc, "message", None) or getattr(exc, "detail", exc))
        if "files" in message.lower():
            raise _error("image", f"too many files: at most {MAX_FORM_FILES} with the mask") from None
        raise _error("content-type", f"not a multipart form this server reads: {message}", 400,
                     loc="header") from None
    try:
        data: dict = {}
        images = []
        for name, value in form.multi_items():
            if name in _FILE_FIELDS:
                if not isinstance(value, UploadFile):
                    raise _error(name.rstrip("[]"), "must be a file (curl -F 'image=@photo.png'), not a text field")
                content = await value.read()
                if name == "mask":
                    if "mask" in data:
                        raise _error("mask", "one mask file, got several")
                    data["mask"] = content
                else:
                    images.append(content)
            elif isinstance(value, UploadFile):
                raise _error(name, "a text field, not a file")
            elif name in data:
                raise _error(name, "given more than once")
            else:
                data[name] = value
    finally:
        await form.close()
    if not images:
        raise _error("image", "required: the image to edit, as a file field 'image'")
    data["image"] = images
    if "cache" in data:
        try:
            data["cache"] = json.loads(data["cache"])
        except ValueError:
            raise _error("cache", 'must be a JSON object, e.g. {"threshold": 0.1}') from None
    try:
        return ImageEditRequest.model_validate(data, strict=False)   # form values are text: "2" is 2
    except ValidationError as exc:
        raise EditFormError([{"loc": ["body", *e.get("loc", ())], "msg": str(e.get("msg", "")),
                              "type": str(e.get("type", ""))} for e in exc.errors()]) from None


def form_openapi() -> dict:
    """The route's ``requestBody`` for the OpenAPI schema: the form's fields (files as binary strings)."""
    properties = {}
    for name, field in ImageEditRequest.model_fields.items():
        if name == "image":
            properties[name] = {"type": "array", "items": {"type": "string", "format": "binary"},
                                "description": "the image to edit (a file; 'image[]' is read as 'image')"}
        elif name == "mask":
            properties[name] = {"type": "string", "format": "binary",
                                "description": "where to repaint: transparent pixels (or white, without alpha)"}
        else:
            properties[name] = {"type": "string", "description": (
                "a JSON object, as on /v1/images/generations" if name == "cache" else
                f"form value ({field.annotation!s})".replace("typing.", ""))}
    schema = {"type": "object", "required": ["image", "prompt"], "properties": properties}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}
