import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('counters', '0008_tombstone'),
    ]

    operations = [
        migrations.CreateModel(
            name='RepairFence',
            fields=[
                ('prefix', models.CharField(max_length=100, primary_key=True, serialize=False)),
                ('token', models.BigIntegerField(default=0, help_text='The newest token issued.')),
                (
                    'issued_at',
                    models.DateTimeField(
                        default=django.utils.timezone.now, help_text='When it was issued.'
                    ),
                ),
            ],
            options={
                'verbose_name': 'repair fence',
                'ordering': ['prefix'],
            },
        ),
    ]
