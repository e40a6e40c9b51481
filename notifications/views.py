from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from .models import UnreadCounter


@never_cache
@require_GET
def unread_count(request: HttpRequest) -> JsonResponse:
    if not request.user.is_authenticated:
        return JsonResponse({"error": "authentication required"}, status=401)
    return JsonResponse({"unread": UnreadCounter.objects.get_count(request.user)})


@login_required
@require_GET
def home(request: HttpRequest) -> JsonResponse:
    return JsonResponse(
        {
            "user": request.user.get_username(),
            "unread": UnreadCounter.objects.get_count(request.user),
        }
    )
