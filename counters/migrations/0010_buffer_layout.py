import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('counters', '0009_repair_fence'),
    ]

    operations = [
        migrations.CreateModel(
            name='BufferLayout',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('prefix', models.CharField(max_length=100)),
                ('shards', models.PositiveSmallIntegerField()),
                ('cluster', models.BooleanField(default=False)),
                ('first_seen_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('retired_at', models.DateTimeField(blank=True, help_text='When a flush under another layout took over; empty: in use.', null=True)),
                ('drained_at', models.DateTimeField(blank=True, help_text='Start of the last complete flush that left nothing of it in Redis.', null=True)),
            ],
            options={
                'verbose_name': 'buffer layout',
                'ordering': ['first_seen_at', 'pk'],
                'constraints': [models.UniqueConstraint(fields=('prefix', 'shards', 'cluster'), name='counters_layout_unique')],
            },
        ),
    ]
