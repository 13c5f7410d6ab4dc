package backup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
)

// S3Config locates a bucket of an S3-compatible object store.
type S3Config struct {
	// Endpoint is the store's URL (https://...); empty means AWS's own for Region.
	Endpoint string
	Region   string
	Bucket   string
	// Prefix is prepended to every snapshot's name (for example "cluster-a/").
	Prefix string
	// AccessKey and SecretKey are the store's credentials.
	AccessKey, SecretKey string
	// PathStyle addresses the bucket in the path, not the host name (most self-hosted stores).
	PathStyle bool
}

// S3 is a Store in a bucket of an S3-compatible object store.
type S3 struct {
	cfg    S3Config
	client *s3.Client
}

// NewS3 returns the store cfg names; it checks nothing until used.
func NewS3(cfg S3Config) (*S3, error) {
	if cfg.Bucket == "" {
		return nil, errors.New("object store: no bucket named")
	}
	if cfg.Region == "" {
		cfg.Region = "us-east-1"
	}
	opts := s3.Options{
		Region:       cfg.Region,
		UsePathStyle: cfg.PathStyle,
		Credentials:  credentials.NewStaticCredentialsProvider(cfg.AccessKey, cfg.SecretKey, ""),
		// Checksums only where the operation needs one: self-hosted stores differ in the rest.
		RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
		ResponseChecksumValidation: aws.ResponseChecksumValidationWhenRequired,
	}
	if cfg.Endpoint != "" {
		opts.BaseEndpoint = aws.String(cfg.Endpoint)
	}
	return &S3{cfg: cfg, client: s3.New(opts)}, nil
}

func (s *S3) String() string { return "object store bucket " + s.cfg.Bucket }

// Put uploads the snapshot in one request.
func (s *S3) Put(ctx context.Context, name string, r io.ReadSeeker, size int64) error {
	if _, err := ParseName(name); err != nil {
		return err
	}
	_, err := s.client.PutObject(ctx, &s3.PutObjectInput{
		Bucket: aws.String(s.cfg.Bucket), Key: aws.String(s.cfg.Prefix + name),
		Body: r, ContentLength: aws.Int64(size), ContentType: aws.String("application/octet-stream"),
	})
	if err != nil {
		return fmt.Errorf("uploading %s to %s: %w", name, s, err)
	}
	return nil
}

// List lists the bucket's snapshots under the prefix.
func (s *S3) List(ctx context.Context) ([]Object, error) {
	var out []Object
	p := s3.NewListObjectsV2Paginator(s.client, &s3.ListObjectsV2Input{
		Bucket: aws.String(s.cfg.Bucket), Prefix: aws.String(s.cfg.Prefix),
	})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			return nil, fmt.Errorf("listing %s: %w", s, err)
		}
		for _, o := range page.Contents {
			name := strings.TrimPrefix(aws.ToString(o.Key), s.cfg.Prefix)
			t, err := ParseName(name)
			if err != nil {
				continue
			}
			out = append(out, Object{Name: name, Taken: t, Size: aws.ToInt64(o.Size)})
		}
	}
	sortObjects(out)
	return out, nil
}

// Get downloads the snapshot name.
func (s *S3) Get(ctx context.Context, name string) (io.ReadCloser, error) {
	if _, err := ParseName(name); err != nil {
		return nil, err
	}
	out, err := s.client.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(s.cfg.Bucket), Key: aws.String(s.cfg.Prefix + name)})
	if err != nil {
		if _, ok := errors.AsType[*types.NoSuchKey](err); ok {
			return nil, fmt.Errorf("%w: %s in %s", ErrNotFound, name, s)
		}
		return nil, fmt.Errorf("downloading %s from %s: %w", name, s, err)
	}
	return out.Body, nil
}

// Delete removes the snapshot name.
func (s *S3) Delete(ctx context.Context, name string) error {
	if _, err := ParseName(name); err != nil {
		return err
	}
	if _, err := s.client.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String(s.cfg.Bucket), Key: aws.String(s.cfg.Prefix + name)}); err != nil {
		return fmt.Errorf("removing %s from %s: %w", name, s, err)
	}
	return nil
}
